"""Reading a decoder's weights from its checkpoint into the layout the forward runs: q/k/v and gate/up fused (a fused
checkpoint such as Phi-3's already is), q and k rows in rotary-pair order, Gemma's norm offsets as multipliers,
quantized at load (int8 / int4 / fp8) or read as a GPTQ / AWQ / FP8 checkpoint stores them, and under tensor
parallelism only this rank's share of each (engine/model/tensor_parallel.py).

One layer at a time: a quantized load never holds more than one layer's float weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.engine.errors import CheckpointError
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.fp8 import load_fp8
from loraplex.engine.model.layers.moe import MoeWeights, SharedExpert
from loraplex.engine.model.layers.norm import gemma_weight
from loraplex.engine.model.layers.rope import rotary_order
from loraplex.engine.model.prequantized import LoadedInt4, PrequantizedFormat, load_int4
from loraplex.engine.model.quant_linear import Weight, int4_group_size, matmul_layout, quantize
from loraplex.engine.model.quantization import QuantizationName
from loraplex.engine.model.tensor_parallel import (
    ShardPlan,
    take_int4_columns,
    take_int8_columns,
    take_rows,
)
from loraplex.engine.model.weights import CheckpointTensors
from loraplex.kernels.quant import Int4Weight, dequantize_int4, quantize_int4, quantize_int8
from loraplex.kernels.quant_fp8 import FP8_DTYPE, Fp8Weight


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]: before attention
    qkv: Weight  # [q_size + 2 * kv_size, hidden]: q, k, v projections stacked, q and k rows in rotary-pair order
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2)
    o: Weight  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]: before the MLP (Llama's post_attention_layernorm, Gemma's pre_feedforward)
    # The dense MLP: None in a mixture-of-experts layer, which has `moe` instead.
    gate_up: Weight | None  # [2 * intermediate, hidden]: gate and up projections stacked
    down: Weight | None  # [hidden, intermediate]
    # Gemma's sandwich norms: on the attention's and the MLP's outputs, before the residual; None elsewhere.
    attn_out_norm: torch.Tensor | None = None  # [hidden]
    mlp_out_norm: torch.Tensor | None = None  # [hidden]
    # Per-head norms of q and k before RoPE (Qwen3, Gemma 3), in rotary-pair order; None elsewhere.
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]
    # GPTQ act-order checkpoints (engine/model/prequantized.py): each projection's input features in the order its
    # weight's columns are stored; None for every other weight.
    qkv_input_order: torch.Tensor | None = None
    o_input_order: torch.Tensor | None = None
    gate_up_input_order: torch.Tensor | None = None
    down_input_order: torch.Tensor | None = None
    moe: MoeWeights | None = None  # a sparse layer's router and experts (engine/model/layers/moe.py)

    def projections(self) -> tuple[Weight, ...]:
        mlp = self.moe.tensors() if self.moe is not None else (self.gate_up, self.down)
        return tuple(w for w in (self.qkv, self.o, *mlp) if w is not None)

    def small_tensors(self) -> list[torch.Tensor]:
        """Norms and biases, which stay in the model's dtype (float32 for Gemma's norms)."""
        parts = [self.input_norm, self.post_norm, self.attn_out_norm, self.mlp_out_norm, self.q_norm, self.k_norm]
        parts.append(self.qkv_bias)
        return [t for t in parts if t is not None]


def qkv_row_order(config: ModelConfig) -> torch.Tensor:
    """The permutation of the fused [q; k; v] rows the engine stores: each head of q and of k in rotary-pair order
    (`rotary_order`), v as it is. Applied to the projection, its bias and any LoRA B that writes into it."""
    per_head = rotary_order(config.head_dim, config.rope.rotary_dim)
    d = config.head_dim
    q = (torch.arange(config.num_heads)[:, None] * d + per_head).reshape(-1)
    k = config.q_size + (torch.arange(config.num_kv_heads)[:, None] * d + per_head).reshape(-1)
    v = config.q_size + config.kv_size + torch.arange(config.kv_size)
    return torch.cat([q, k, v])


def _stack(prefix: str, parts: list[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """Projections fused by rows (q, k, v; gate, up), all float or all FP8."""
    if all(isinstance(part, torch.Tensor) for part in parts):
        return torch.cat(parts)  # type: ignore[arg-type]
    if not all(isinstance(part, Fp8Weight) for part in parts):
        raise CheckpointError(f"'{prefix}': the projections to fuse are FP8 and 16-bit mixed; loraplex fuses like ones")
    try:
        return Fp8Weight.stack(parts)  # type: ignore[arg-type]
    except ValueError as exc:
        raise CheckpointError(f"'{prefix}': {exc}") from None


def _rows(weight: torch.Tensor | Fp8Weight, rows: torch.Tensor) -> torch.Tensor | Fp8Weight:
    if isinstance(weight, Fp8Weight):
        return weight.rows(rows.to(weight.qweight.device))
    return take_rows(weight, rows)


def _map_rows(w: Int4Weight, reorder: Callable[[torch.Tensor], torch.Tensor]) -> Int4Weight:
    """The same output rows of every per-row tensor of an int4 weight, reordered by `reorder`."""
    return Int4Weight(reorder(w.packed), reorder(w.scales), reorder(w.zeros), w.group_size)


def _stack_rows(parts: list[Int4Weight]) -> Int4Weight:
    """int4 weights of the same width and group size, stacked along the output rows (a fused projection)."""
    return Int4Weight(
        torch.cat([w.packed for w in parts]),
        torch.cat([w.scales for w in parts]),
        torch.cat([w.zeros for w in parts]),
        parts[0].group_size,
    )


def _same_order(prefix: str, names: str, parts: list[LoadedInt4]) -> torch.Tensor | None:
    """The one input order of projections the model fuses; a CheckpointError if they were stored in different ones."""
    first = parts[0].input_order
    for part in parts[1:]:
        other = part.input_order
        same = (first is None and other is None) or (
            first is not None and other is not None and torch.equal(first, other)
        )
        if not same:
            raise CheckpointError(
                f"'{prefix}': the {names} projections were quantized with different act-order (g_idx) orders; "
                "loraplex computes them as one matrix and needs one order"
            )
    return first


class WeightLoader:
    """Turns a checkpoint's tensors into the decoder's weights, for one rank of `shard` (None: the whole model)."""

    def __init__(
        self,
        tensors: CheckpointTensors,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        quantization: QuantizationName | None,
        shard: ShardPlan | None,
    ) -> None:
        self.tensors = tensors
        self.config = config
        self.dtype = dtype
        self.device = device
        self.quantization = quantization
        self.shard = shard
        self.prefix = "" if config.headless else "model."
        self._qkv_order = qkv_row_order(config)

    def check(self) -> None:
        """What a checkpoint must not combine, before any tensor is read."""
        c, names = self.config, self.tensors.names
        if c.fp8 is not None and self.quantization is not None:
            raise CheckpointError(
                f"the checkpoint is already quantized (FP8, {c.fp8.method}); leave quantization unset to serve it as "
                f"it is, not {self.quantization!r}"
            )
        if c.prequantized is not None and self.quantization is not None:
            raise CheckpointError(
                f"the checkpoint is already quantized ({c.prequantized.method.upper()}, 4-bit); leave quantization "
                f"unset to serve it as it is, not {self.quantization!r}"
            )
        if c.prequantized is not None and "lm_head.qweight" in names:
            raise CheckpointError(
                "the checkpoint's lm_head is quantized ('lm_head.qweight'); loraplex loads "
                f"{c.prequantized.method.upper()} checkpoints whose lm_head is 16/32-bit (quantized with lm_head false)"
            )
        packed = sorted(n for n in names if n.endswith((".qweight", ".qzeros", ".g_idx")))
        if packed and c.prequantized is None:
            raise CheckpointError(
                f"the checkpoint holds pre-quantized tensors ('{packed[0]}', GPTQ/AWQ) but config.json has no "
                "'quantization_config' saying how: give a GPTQ/AWQ checkpoint with its config, or a 16/32-bit "
                "checkpoint and quantization='int8' or 'int4' to quantize it at load"
            )
        if c.moe is not None:
            if self.quantization is not None:
                raise CheckpointError(
                    f"quantization {self.quantization!r} of a mixture-of-experts base ({c.architecture}) is not "
                    "supported yet: serve it in 16/32 bits"
                )
            if c.fp8 is not None or c.prequantized is not None:
                raise CheckpointError(
                    f"quantized mixture-of-experts checkpoints ({c.architecture}) are not supported yet: give its "
                    "16/32-bit weights"
                )
            if self.shard is not None:
                raise CheckpointError(
                    f"tensor parallelism over a mixture-of-experts base ({c.architecture}) is not supported yet: "
                    "use tensor_parallel_size 1"
                )
        if (
            c.headless
            and not any(n.startswith("layers.") for n in names)
            and any(n.startswith("model.") for n in names)
        ):
            self.prefix = "model."  # a bare-decoder config beside a causal LM's tensor names

    # --- embeddings, final norm, lm_head ----------------------------------------------------------------------

    def embedding(self) -> torch.Tensor:
        c = self.config
        return self.vocab_rows(self.take(self.prefix + "embed_tokens.weight", (c.vocab_size, c.hidden_size)))

    def final_norm(self) -> torch.Tensor:
        return self.norm(self.prefix + "norm.weight")

    def lm_head(self, embed: torch.Tensor) -> Weight | None:
        """The output layer: the embedding table itself when tied, None for a headless checkpoint without one; an
        untied one int8 when quantizing to int8 or int4 (the logits are where 4 bits would cost the most, as
        llama.cpp's 4-bit mixes keep their output layer at 6 bits; in decode it is the largest matmul of a small
        model; decision 0039), FP8 where an FP8 checkpoint stores it so, else in the model's dtype (`fp8` at load
        leaves it there, as vLLM does)."""
        c = self.config
        present = "lm_head.weight" in self.tensors.names
        if c.tie_word_embeddings:
            return embed
        if not present:
            if c.headless:
                return None
            raise CheckpointError("the checkpoint has no 'lm_head.weight' and config.json does not tie embeddings")
        shape = (c.vocab_size, c.hidden_size)
        if c.fp8 is not None:  # an FP8 lm_head (most checkpoints leave it in 16 bits: then None here)
            head = load_fp8(self.tensors, "lm_head", c.fp8, shape)
            if head is not None:
                head = head.to(self.device)
                return head if self.shard is None else head.rows(slice(self.shard.vocab.start, self.shard.vocab.stop))
        if self.quantization in ("int8", "int4"):
            return quantize_int8(self.vocab_rows(self.take("lm_head.weight", shape, dtype=torch.float32)))
        return matmul_layout(self.vocab_rows(self.take("lm_head.weight", shape)))

    def vocab_rows(self, table: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a [vocab, hidden] table (all of them without tensor parallelism)."""
        if self.shard is None:
            return table
        vocab = self.shard.vocab
        return table[vocab.start : vocab.stop].contiguous()

    def norm(self, name: str, size: int | None = None) -> torch.Tensor:
        weight = self.take(name, (size or self.config.hidden_size,))
        return gemma_weight(weight) if self.config.norm_kind == "gemma" else weight

    # --- one decoder layer -------------------------------------------------------------------------------------

    def layer(self, i: int) -> LayerWeights:
        c = self.config
        p = f"{self.prefix}layers.{i}."
        weights = self._prequantized_layer(p, c.prequantized) if c.prequantized is not None else self._float_layer(p, i)
        if c.sandwich_norms:
            weights.post_norm = self.norm(p + "pre_feedforward_layernorm.weight")
            weights.attn_out_norm = self.norm(p + "post_attention_layernorm.weight")
            weights.mlp_out_norm = self.norm(p + "post_feedforward_layernorm.weight")
        if c.qk_norm:
            order = rotary_order(c.head_dim, c.rope.rotary_dim).to(self.device)
            weights.q_norm = self.norm(p + "self_attn.q_norm.weight", c.head_dim)[order].contiguous()
            weights.k_norm = self.norm(p + "self_attn.k_norm.weight", c.head_dim)[order].contiguous()
        return weights

    def _float_layer(self, p: str, index: int) -> LayerWeights:
        c = self.config
        # Quantized projections are read in float32, so the rounding starts from the checkpoint's own values.
        proj_dtype = torch.float32 if self.quantization is not None else self.dtype

        def proj(name: str, shape: tuple[int, int]) -> torch.Tensor | Fp8Weight:
            if c.fp8 is not None:  # FP8 where the checkpoint stores it so; a module it left in 16 bits is float
                loaded = load_fp8(self.tensors, p + name.removesuffix(".weight"), c.fp8, shape)
                if loaded is not None:
                    return loaded.to(self.device)
            return self.take(p + name, shape, dtype=proj_dtype)

        if c.moe is not None and c.moe.is_sparse(index):
            qkv = _stack(
                p + "self_attn",
                [
                    proj("self_attn.q_proj.weight", (c.q_size, c.hidden_size)),
                    proj("self_attn.k_proj.weight", (c.kv_size, c.hidden_size)),
                    proj("self_attn.v_proj.weight", (c.kv_size, c.hidden_size)),
                ],
            )
            return LayerWeights(
                input_norm=self.norm(p + "input_layernorm.weight"),
                qkv=self._column(_rows(qkv, self._qkv_order), None),
                qkv_bias=self._qkv_bias(p),
                o=self._row(proj("self_attn.o_proj.weight", (c.hidden_size, c.q_size)), None),
                post_norm=self.norm(p + "post_attention_layernorm.weight"),
                gate_up=None,
                down=None,
                moe=self._experts(p),
            )
        if c.fused_projections:
            qkv = proj("self_attn.qkv_proj.weight", (c.q_size + 2 * c.kv_size, c.hidden_size))
            gate_up = proj("mlp.gate_up_proj.weight", (2 * c.intermediate_size, c.hidden_size))
        else:
            qkv = _stack(
                p + "self_attn",
                [
                    proj("self_attn.q_proj.weight", (c.q_size, c.hidden_size)),
                    proj("self_attn.k_proj.weight", (c.kv_size, c.hidden_size)),
                    proj("self_attn.v_proj.weight", (c.kv_size, c.hidden_size)),
                ],
            )
            gate_up = _stack(
                p + "mlp",
                [
                    proj("mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
                    proj("mlp.up_proj.weight", (c.intermediate_size, c.hidden_size)),
                ],
            )
        qkv = _rows(qkv, self._qkv_order)
        shard = self.shard
        return LayerWeights(
            input_norm=self.norm(p + "input_layernorm.weight"),
            qkv=self._column(qkv, shard.qkv_rows() if shard is not None else None),
            qkv_bias=self._qkv_bias(p),
            o=self._row(proj("self_attn.o_proj.weight", (c.hidden_size, c.q_size)), shard.q_columns if shard else None),
            post_norm=self.norm(p + "post_attention_layernorm.weight"),
            gate_up=self._column(gate_up, shard.gate_up_rows() if shard is not None else None),
            down=self._row(
                proj("mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)),
                shard.mlp_columns if shard is not None else None,
            ),
        )

    def _experts(self, p: str) -> MoeWeights:
        """A sparse layer's router and experts, from either layout transformers writes (see moe_families.py):
        stacked input-major, [experts, hidden, 2 * intermediate] and [experts, intermediate, hidden]."""
        c = self.config
        assert c.moe is not None
        e, h, i = c.moe.num_experts, c.hidden_size, c.moe.intermediate_size
        names = self.tensors.names
        # Mixtral's own checkpoints name the block `block_sparse_moe`; transformers' fused layout names it `mlp`.
        block = p + "mlp."
        if c.architecture == "mixtral" and block + "gate.weight" not in names:
            block = p + "block_sparse_moe."
        router = self.take(block + "gate.weight", (e, h))
        if block + "experts.gate_up_proj" in names:
            gate_up = self.take(block + "experts.gate_up_proj", (e, 2 * i, h))
            down = self.take(block + "experts.down_proj", (e, h, i))
        else:
            gate, up, down_name = (
                ("w1", "w3", "w2") if c.architecture == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            )
            gate_up = torch.stack(
                [
                    torch.cat(
                        [
                            self.take(f"{block}experts.{n}.{gate}.weight", (i, h)),
                            self.take(f"{block}experts.{n}.{up}.weight", (i, h)),
                        ]
                    )
                    for n in range(e)
                ]
            )
            down = torch.stack([self.take(f"{block}experts.{n}.{down_name}.weight", (h, i)) for n in range(e)])
        shared = None
        if c.moe.shared_intermediate_size:
            s, name = c.moe.shared_intermediate_size, block + "shared_expert."
            shared = SharedExpert(
                gate=self.take(block + "shared_expert_gate.weight", (1, h)),
                gate_up=torch.cat(
                    [self.take(name + "gate_proj.weight", (s, h)), self.take(name + "up_proj.weight", (s, h))]
                ),
                down=self.take(name + "down_proj.weight", (h, s)),
            )
        return MoeWeights(
            router=router,
            gate_up=gate_up.transpose(1, 2).contiguous(),
            down=down.transpose(1, 2).contiguous(),
            shared=shared,
        )

    def _prequantized_layer(self, p: str, fmt: PrequantizedFormat) -> LayerWeights:
        """A GPTQ/AWQ layer: the projections as Int4Weight (the checkpoint's codes, scales and zeros), q and k rows
        reordered for the rotary pairs and the fused projections stacked, as the float path does; under tensor
        parallelism, this rank's rows and columns of them (`_split_prequantized`)."""
        c = self.config

        def proj(name: str, shape: tuple[int, int]) -> LoadedInt4:
            return load_int4(self.tensors, p + name, fmt, shape)

        if c.fused_projections:
            qkv = [proj("self_attn.qkv_proj", (c.q_size + 2 * c.kv_size, c.hidden_size))]
            gate_up = [proj("mlp.gate_up_proj", (2 * c.intermediate_size, c.hidden_size))]
        else:
            qkv = [
                proj("self_attn.q_proj", (c.q_size, c.hidden_size)),
                proj("self_attn.k_proj", (c.kv_size, c.hidden_size)),
                proj("self_attn.v_proj", (c.kv_size, c.hidden_size)),
            ]
            gate_up = [
                proj("mlp.gate_proj", (c.intermediate_size, c.hidden_size)),
                proj("mlp.up_proj", (c.intermediate_size, c.hidden_size)),
            ]
        o = proj("self_attn.o_proj", (c.hidden_size, c.q_size))
        down = proj("mlp.down_proj", (c.hidden_size, c.intermediate_size))
        shard = self.shard
        qkv_weight = _map_rows(_stack_rows([part.weight for part in qkv]), lambda r: take_rows(r, self._qkv_order))
        gate_up_weight = _stack_rows([part.weight for part in gate_up])
        o_weight: Weight = o.weight
        down_weight: Weight = down.weight
        o_order, down_order = o.input_order, down.input_order
        if shard is not None:
            qkv_weight = _map_rows(qkv_weight, lambda rows: take_rows(rows, shard.qkv_rows()))
            gate_up_weight = _map_rows(gate_up_weight, lambda rows: take_rows(rows, shard.gate_up_rows()))
            o_weight, o_order = self._split_prequantized(o, shard.q_columns, p + "self_attn.o_proj")
            down_weight, down_order = self._split_prequantized(down, shard.mlp_columns, p + "mlp.down_proj")
        return LayerWeights(
            input_norm=self.norm(p + "input_layernorm.weight"),
            qkv=qkv_weight,
            qkv_bias=self._qkv_bias(p),
            o=o_weight,
            post_norm=self.norm(p + "post_attention_layernorm.weight"),
            gate_up=gate_up_weight,
            down=down_weight,
            qkv_input_order=_same_order(p + "self_attn", "q, k and v", qkv),
            o_input_order=o_order,
            gate_up_input_order=_same_order(p + "mlp", "gate and up", gate_up),
            down_input_order=down_order,
        )

    def _qkv_bias(self, p: str) -> torch.Tensor | None:
        """The q, k, v biases stacked in the fused rows' order (this rank's rows), or None."""
        c = self.config
        if not c.attention_bias:
            return None
        if c.fused_projections:
            bias = self.take(p + "self_attn.qkv_proj.bias", (c.q_size + 2 * c.kv_size,))
        else:
            bias = torch.cat(
                [
                    self.take(p + "self_attn.q_proj.bias", (c.q_size,)),
                    self.take(p + "self_attn.k_proj.bias", (c.kv_size,)),
                    self.take(p + "self_attn.v_proj.bias", (c.kv_size,)),
                ]
            )
        bias = take_rows(bias, self._qkv_order)
        return take_rows(bias, self.shard.qkv_rows()) if self.shard is not None else bias

    def _column(self, weight: torch.Tensor | Fp8Weight, rows: torch.Tensor | None) -> Weight:
        """A column-parallel projection: this rank's output rows (quantization is per row, so splitting first
        gives TP=1's codes for them)."""
        return self._quantized(weight if rows is None else _rows(weight, rows))

    def _row(self, weight: torch.Tensor | Fp8Weight, columns: range | None) -> Weight:
        """A row-parallel projection: this rank's input columns, quantized as TP=1 quantizes the whole (int8 and fp8
        scales over whole rows, int4 groups of the whole width's size)."""
        if isinstance(weight, Fp8Weight):
            if columns is None:
                return weight
            try:
                return weight.columns(columns.start, columns.stop)
            except ValueError:
                raise CheckpointError(
                    f"the checkpoint's FP8 scale blocks of {weight.col_block} input features do not split evenly over "
                    f"{self.num_ranks} ranks: use fewer ranks"
                ) from None
        if columns is None:
            return self._quantized(weight)
        if self.quantization == "int8":
            return take_int8_columns(quantize_int8(weight), columns)
        if self.quantization == "fp8":
            return quantize(weight, "fp8").columns(columns.start, columns.stop)  # type: ignore[union-attr]
        part = weight[:, columns.start : columns.stop].contiguous()
        if self.quantization == "int4":
            group_size = int4_group_size(weight.shape[1])
            if columns.start % group_size or columns.stop % group_size:
                raise CheckpointError(
                    f"int4 groups of {group_size} input features do not split evenly over {self.num_ranks} "
                    f"ranks ({weight.shape[1]} features): use fewer ranks, or int8"
                )
            return quantize_int4(part, group_size=group_size)
        return matmul_layout(part)

    def _split_prequantized(self, loaded: LoadedInt4, columns: range, name: str) -> tuple[Weight, torch.Tensor | None]:
        """A pre-quantized row-parallel projection's input columns for this rank, and the order its input is read in.

        Without act-order the rank keeps whole groups of the checkpoint's codes. With act-order the columns of the
        rank's inputs are scattered over every group, so no grouping of the codes fits them: the rank keeps those
        columns dequantized to the model's dtype (four times their 4-bit size in bf16) and reads its inputs in their
        stored order (decision 0040)."""
        weight, order = loaded.weight, loaded.input_order
        if order is None:
            try:
                return take_int4_columns(weight, columns), None
            except ValueError:
                raise CheckpointError(
                    f"'{name}': the checkpoint's groups of {weight.group_size} input features do not split evenly over "
                    f"{self.num_ranks} ranks: use fewer ranks"
                ) from None
        kept = torch.nonzero((order >= columns.start) & (order < columns.stop)).flatten()
        values = dequantize_int4(weight, torch.float32).index_select(1, kept.to(weight.packed.device))
        return matmul_layout(values.to(self.dtype).contiguous()), (order[kept] - columns.start).contiguous()

    @property
    def num_ranks(self) -> int:
        return self.shard.size if self.shard is not None else 1

    def _quantized(self, weight: torch.Tensor | Fp8Weight) -> Weight:
        if isinstance(weight, Fp8Weight):
            return weight
        if self.quantization is None:
            return matmul_layout(weight)
        try:
            return quantize(weight, self.quantization)
        except ValueError as exc:
            raise CheckpointError(f"quantization {self.quantization!r} does not fit this model: {exc}") from None

    def take(self, name: str, shape: tuple[int, ...], *, dtype: torch.dtype | None = None) -> torch.Tensor:
        tensor = self.tensors.get_shaped(name, shape)
        if tensor.dtype in (FP8_DTYPE, torch.float8_e5m2):
            raise CheckpointError(
                f"tensor '{name}' in {self.tensors.file_of(name)} is {tensor.dtype}, but config.json's "
                "quantization_config names no FP8 scheme for it: loraplex reads FP8 weights with the scales its "
                "'fp8' or 'compressed-tensors' quantization_config describes"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(
                f"tensor '{name}' in {self.tensors.file_of(name)} has dtype {tensor.dtype}: loraplex loads 16/32-bit "
                "checkpoints (for int8 or int4 weights, set quantization on a 16/32-bit checkpoint)"
            )
        return tensor.to(device=self.device, dtype=dtype or self.dtype).contiguous()
