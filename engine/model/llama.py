"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

Weights are plain tensors, fused where one matmul can do the work of several (q/k/v, gate/up): fewer, larger
matmuls are what a CPU (and a GPU at small batch) runs fastest. On a CPU, float32 projections and an untied
lm_head are kept input-major (quant_linear.matmul_layout), the layout MKL multiplies fastest at decode sizes.
With quantization the four projections of each layer are int8 or int4 weight objects instead
(engine/model/quant_linear.py), quantized at load one layer at a time, and an untied lm_head becomes int8;
everything else stays in the model's dtype.
Every forward takes a ForwardBatch of flat tokens from many sequences at once; attention reads each sequence's
keys through its block table.
Under tensor parallelism (a `ShardPlan` and a `Communicator`) the model keeps one rank's share of every weight, as
engine/model/tensor_parallel.py splits them, and its forward sums the row-parallel products over the ranks; `config`
is then the rank's local config (its heads and MLP slice), `checkpoint_config` the whole model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.engine.errors import CheckpointError
from loraplex.engine.memory.page_pool import KVLayer
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.forward_batch import ForwardBatch
from loraplex.engine.model.prequantized import LoadedInt4, PrequantizedFormat, load_int4
from loraplex.engine.model.quant_linear import (
    Weight,
    addmm,
    int4_group_size,
    linear,
    matmul_layout,
    nbytes,
    quantize,
)
from loraplex.engine.model.quantization import QuantizationName
from loraplex.engine.model.rope import RotaryEmbedding, interleave_rotary_rows
from loraplex.engine.model.tensor_parallel import (
    Communicator,
    ShardPlan,
    take_int4_columns,
    take_int8_columns,
    take_rows,
)
from loraplex.engine.model.weights import CheckpointTensors
from loraplex.kernels.paged_attention import paged_attention
from loraplex.kernels.quant import Int4Weight, dequantize_int4, quantize_int4, quantize_int8

# A row-major lm_head (half types, tied embeddings) in vocabulary slices this tall: the slice of weights stays in
# cache while every row uses it (decision 0019 has the figures). A float32 one is stored input-major
# (matmul_layout) and runs whole, which is fastest for that layout.
_LM_HEAD_SLICE = 2048


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Weight  # [q_size + 2 * kv_size, hidden]: q, k, v projections stacked
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2)
    o: Weight  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Weight  # [2 * intermediate, hidden]: gate and up projections stacked
    down: Weight  # [hidden, intermediate]
    # GPTQ act-order checkpoints (engine/model/prequantized.py): each projection's input features in the order its
    # weight's columns are stored; None for every other weight.
    qkv_input_order: torch.Tensor | None = None
    o_input_order: torch.Tensor | None = None
    gate_up_input_order: torch.Tensor | None = None
    down_input_order: torch.Tensor | None = None

    def projections(self) -> tuple[Weight, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


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


def _ordered(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """x's features in a projection's stored column order (GPTQ act-order), else x itself."""
    return x if order is None else x.index_select(1, order)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel; same arithmetic in float32
    # Half types: computed in float32 and cast back before the weight, exactly as transformers does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        quantization: QuantizationName | None = None,
        shard: ShardPlan | None = None,
        comm: Communicator | None = None,
    ) -> None:
        if (shard is None) != (comm is None) or (shard is not None and comm is not None and shard.size != comm.size):
            raise ValueError("a sharded model needs its plan and a communicator of the same size")
        parallel = shard is not None and shard.size > 1
        self.shard = shard if parallel else None
        self.comm = comm if parallel else None
        self.checkpoint_config = config
        self.config = shard.local if shard is not None and parallel else config
        self.dtype = dtype
        self.quantization = quantization
        self.device = device
        self.rope = RotaryEmbedding(
            config.head_dim,
            max_positions,
            config.rope_theta,
            config.rope_scaling,
            device=device,
        )
        self.scale = config.head_dim**-0.5
        self.layers: list[LayerWeights] = []
        self.embed = torch.empty(0)
        self.norm = torch.empty(0)
        self.lm_head: Weight = torch.empty(0)

    # --- loading -------------------------------------------------------------------------------------------------

    @property
    def quantization_label(self) -> str | None:
        """What the layers' weights are: "int8" / "int4" (quantized at load), "gptq" / "awq" (read as the
        checkpoint holds them), or None."""
        if self.config.prequantized is not None:
            return self.config.prequantized.method
        return self.quantization

    def load(self, tensors: CheckpointTensors) -> None:
        c = self.checkpoint_config
        if c.prequantized is not None and self.quantization is not None:
            raise CheckpointError(
                f"the checkpoint is already quantized ({c.prequantized.method.upper()}, 4-bit); leave quantization "
                f"unset to serve it as it is, not {self.quantization!r}"
            )
        if c.prequantized is not None and "lm_head.qweight" in tensors.names:
            raise CheckpointError(
                "the checkpoint's lm_head is quantized ('lm_head.qweight'); loraplex loads "
                f"{c.prequantized.method.upper()} checkpoints whose lm_head is 16/32-bit (quantized with lm_head false)"
            )
        packed = sorted(n for n in tensors.names if n.endswith((".qweight", ".qzeros", ".g_idx")))
        if packed and c.prequantized is None:
            raise CheckpointError(
                f"the checkpoint holds pre-quantized tensors ('{packed[0]}', GPTQ/AWQ) but config.json has no "
                "'quantization_config' saying how: give a GPTQ/AWQ checkpoint with its config, or a 16/32-bit "
                "checkpoint and quantization='int8' or 'int4' to quantize it at load"
            )
        self.embed = self._vocab_rows(self._take(tensors, "model.embed_tokens.weight", (c.vocab_size, c.hidden_size)))
        self.norm = self._take(tensors, "model.norm.weight", (c.hidden_size,))
        if c.tie_word_embeddings or "lm_head.weight" not in tensors.names:
            if not c.tie_word_embeddings:
                raise CheckpointError("the checkpoint has no 'lm_head.weight' and config.json does not tie embeddings")
            self.lm_head = self.embed
        else:
            self.lm_head = self._head(tensors)
        # One layer at a time: a quantized load never holds more than one layer's float weights.
        self.layers = [self._load_layer(tensors, i) for i in range(c.num_layers)]

    def _load_layer(self, tensors: CheckpointTensors, i: int) -> LayerWeights:
        c = self.checkpoint_config
        p = f"model.layers.{i}."
        if c.prequantized is not None:
            return self._load_prequantized_layer(tensors, i, c.prequantized)
        # Quantized projections are read in float32, so the rounding starts from the checkpoint's own values.
        proj_dtype = torch.float32 if self.quantization is not None else self.dtype

        def proj(name: str, shape: tuple[int, int]) -> torch.Tensor:
            return self._take(tensors, p + name, shape, dtype=proj_dtype)

        q = proj("self_attn.q_proj.weight", (c.q_size, c.hidden_size))
        k = proj("self_attn.k_proj.weight", (c.kv_size, c.hidden_size))
        v = proj("self_attn.v_proj.weight", (c.kv_size, c.hidden_size))
        q = interleave_rotary_rows(q, c.num_heads, c.head_dim)
        k = interleave_rotary_rows(k, c.num_kv_heads, c.head_dim)
        bias = self._qkv_bias(tensors, p)
        gate = proj("mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size))
        up = proj("mlp.up_proj.weight", (c.intermediate_size, c.hidden_size))
        shard = self.shard
        return LayerWeights(
            input_norm=self._take(tensors, p + "input_layernorm.weight", (c.hidden_size,)),
            qkv=self._column(torch.cat([q, k, v]), shard.qkv_rows() if shard is not None else None),
            qkv_bias=bias,
            o=self._row(
                proj("self_attn.o_proj.weight", (c.hidden_size, c.q_size)),
                shard.q_columns if shard is not None else None,
            ),
            post_norm=self._take(tensors, p + "post_attention_layernorm.weight", (c.hidden_size,)),
            gate_up=self._column(torch.cat([gate, up]), shard.gate_up_rows() if shard is not None else None),
            down=self._row(
                proj("mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)),
                shard.mlp_columns if shard is not None else None,
            ),
        )

    def _load_prequantized_layer(self, tensors: CheckpointTensors, i: int, fmt: PrequantizedFormat) -> LayerWeights:
        """A GPTQ/AWQ layer: the projections as Int4Weight (the checkpoint's codes, scales and zeros), q and k rows
        reordered for the rotary pairs and the fused projections stacked, as the float path does; under tensor
        parallelism, this rank's rows and columns of them (`_split_prequantized`)."""
        c = self.checkpoint_config
        p = f"model.layers.{i}."

        def proj(name: str, shape: tuple[int, int]) -> LoadedInt4:
            return load_int4(tensors, p + name, fmt, shape)

        def rotary(loaded: LoadedInt4, num_heads: int) -> LoadedInt4:
            w = _map_rows(loaded.weight, lambda rows: interleave_rotary_rows(rows, num_heads, c.head_dim))
            return LoadedInt4(w, loaded.input_order)

        qkv = [
            rotary(proj("self_attn.q_proj", (c.q_size, c.hidden_size)), c.num_heads),
            rotary(proj("self_attn.k_proj", (c.kv_size, c.hidden_size)), c.num_kv_heads),
            proj("self_attn.v_proj", (c.kv_size, c.hidden_size)),
        ]
        o = proj("self_attn.o_proj", (c.hidden_size, c.q_size))
        gate_up = [
            proj("mlp.gate_proj", (c.intermediate_size, c.hidden_size)),
            proj("mlp.up_proj", (c.intermediate_size, c.hidden_size)),
        ]
        down = proj("mlp.down_proj", (c.hidden_size, c.intermediate_size))
        shard = self.shard
        qkv_weight = _stack_rows([part.weight for part in qkv])
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
            input_norm=self._take(tensors, p + "input_layernorm.weight", (c.hidden_size,)),
            qkv=qkv_weight,
            qkv_bias=self._qkv_bias(tensors, p),
            o=o_weight,
            post_norm=self._take(tensors, p + "post_attention_layernorm.weight", (c.hidden_size,)),
            gate_up=gate_up_weight,
            down=down_weight,
            qkv_input_order=_same_order(p + "self_attn", "q, k and v", qkv),
            o_input_order=o_order,
            gate_up_input_order=_same_order(p + "mlp", "gate and up", gate_up),
            down_input_order=down_order,
        )

    def _qkv_bias(self, tensors: CheckpointTensors, p: str) -> torch.Tensor | None:
        """Qwen2's q, k, v biases stacked (q and k rows in rotary-pair order; this rank's rows), or None."""
        c = self.checkpoint_config
        if not c.attention_bias:
            return None
        bias = torch.cat(
            [
                interleave_rotary_rows(
                    self._take(tensors, p + "self_attn.q_proj.bias", (c.q_size,)), c.num_heads, c.head_dim
                ),
                interleave_rotary_rows(
                    self._take(tensors, p + "self_attn.k_proj.bias", (c.kv_size,)), c.num_kv_heads, c.head_dim
                ),
                self._take(tensors, p + "self_attn.v_proj.bias", (c.kv_size,)),
            ]
        )
        return take_rows(bias, self.shard.qkv_rows()) if self.shard is not None else bias

    def _head(self, tensors: CheckpointTensors) -> Weight:
        """An untied lm_head: int8 when quantizing (int4 too: the logits are where 4 bits would cost the most, as
        llama.cpp's 4-bit mixes keep their output layer at 6 bits; in decode it is the largest matmul of a small
        model, 16M of the benchmark model's 40M multiply-adds per token; decision 0039), else in the model's dtype."""
        shape = (self.checkpoint_config.vocab_size, self.checkpoint_config.hidden_size)
        if self.quantization is not None:
            return quantize_int8(self._vocab_rows(self._take(tensors, "lm_head.weight", shape, dtype=torch.float32)))
        return matmul_layout(self._vocab_rows(self._take(tensors, "lm_head.weight", shape)))

    def _vocab_rows(self, table: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a [vocab, hidden] table (all of them without tensor parallelism)."""
        if self.shard is None:
            return table
        vocab = self.shard.vocab
        return table[vocab.start : vocab.stop].contiguous()

    def _column(self, weight: torch.Tensor, rows: torch.Tensor | None) -> Weight:
        """A column-parallel projection: this rank's output rows (quantization is per row, so splitting first
        gives TP=1's codes for them)."""
        return self._quantized(weight if rows is None else take_rows(weight, rows))

    def _row(self, weight: torch.Tensor, columns: range | None) -> Weight:
        """A row-parallel projection: this rank's input columns, quantized as TP=1 quantizes the whole (int8 scales
        over whole rows, int4 groups of the whole width's size)."""
        if columns is None:
            return self._quantized(weight)
        if self.quantization == "int8":
            return take_int8_columns(quantize_int8(weight), columns)
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
        """Ranks the model is split over (1: not split)."""
        return self.shard.size if self.shard is not None else 1

    def _quantized(self, weight: torch.Tensor) -> Weight:
        if self.quantization is None:
            return matmul_layout(weight)
        try:
            return quantize(weight, self.quantization)
        except ValueError as exc:
            raise CheckpointError(f"quantization {self.quantization!r} does not fit this model: {exc}") from None

    def _take(
        self, tensors: CheckpointTensors, name: str, shape: tuple[int, ...], *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        tensor = tensors.get_shaped(name, shape)
        if not tensor.is_floating_point():
            raise CheckpointError(
                f"tensor '{name}' in {tensors.file_of(name)} has dtype {tensor.dtype}: loraplex loads 16/32-bit "
                "checkpoints (for int8 or int4 weights, set quantization on a 16/32-bit checkpoint)"
            )
        return tensor.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def weight_bytes(self) -> int:
        """Bytes of every weight the model keeps: quantized projections with their scales and zero points, and
        the parts in the model's dtype (embeddings, lm_head unless tied, norms, biases)."""
        weights: list[Weight] = [self.embed, self.norm]
        if self.lm_head is not self.embed:
            weights.append(self.lm_head)
        for layer in self.layers:
            weights += [layer.input_norm, layer.post_norm, *layer.projections()]
            if layer.qkv_bias is not None:
                weights.append(layer.qkv_bias)
        return sum(nbytes(w) for w in weights)

    def projection_bytes(self) -> int:
        """Bytes of the layers' four projections (quantization also changes an untied lm_head: see _head)."""
        return sum(nbytes(w) for layer in self.layers for w in layer.projections())

    # --- forward -------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[KVLayer]) -> torch.Tensor:
        """Run the decoder over the batch's tokens, writing their K/V into the cache; returns the final-normed
        hidden states [num_tokens, hidden]."""
        c = self.config
        hidden = self._embed(batch.input_ids)
        cis = self.rope.table(batch.positions)
        adapters = batch.lora
        for index, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps)
            qkv = linear(_ordered(x, layer.qkv_input_order), layer.qkv, layer.qkv_bias)
            if adapters is not None:
                adapters.add(index, "qkv", x, qkv)
            q, k, v = torch.split(qkv, [c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = self.rope.apply(q.view(-1, c.num_heads, c.head_dim), cis)
            k = self.rope.apply(k.view(-1, c.num_kv_heads, c.head_dim), cis)
            # index_copy_ of whole head_dim rows: far cheaper than advanced-index assignment into the strided view.
            cache.rows.index_copy_(0, batch.k_rows, k.reshape(-1, c.head_dim))
            cache.rows.index_copy_(0, batch.v_rows, v.reshape(-1, c.head_dim))
            attn = paged_attention(
                q,
                cache.k,
                cache.v,
                batch.block_tables,
                batch.seq_lens,
                batch.query_start_loc,
                scale=self.scale,
                max_query_len=batch.max_query_len,
                max_seq_len=batch.max_seq_len,
            )
            attn = attn.view(-1, c.q_size)
            hidden = self._row_parallel(hidden, _ordered(attn, layer.o_input_order), layer.o)
            if adapters is not None:
                adapters.add(index, "o", attn, hidden)
            if self.comm is not None:
                self.comm.all_reduce(hidden)

            x = rms_norm(hidden, layer.post_norm, c.rms_norm_eps)
            gate_up = linear(_ordered(x, layer.gate_up_input_order), layer.gate_up)
            if adapters is not None:
                adapters.add(index, "gate_up", x, gate_up)
            act = F.silu(gate_up[:, : c.intermediate_size])
            act.mul_(gate_up[:, c.intermediate_size :])  # in place: a fresh large tensor costs page faults
            hidden = self._row_parallel(hidden, _ordered(act, layer.down_input_order), layer.down)
            if adapters is not None:
                adapters.add(index, "down", act, hidden)
            if self.comm is not None:
                self.comm.all_reduce(hidden)
        return rms_norm(hidden, self.norm, c.rms_norm_eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None or self.comm is None:
            return F.embedding(input_ids, self.embed)
        # Vocabulary-parallel: this rank's rows, zeros for the tokens other ranks hold, summed over the ranks.
        vocab = self.shard.vocab
        local = input_ids - vocab.start
        outside = (local < 0) | (local >= len(vocab))
        hidden = F.embedding(local.clamp(0, max(len(vocab) - 1, 0)), self.embed)
        hidden.masked_fill_(outside.unsqueeze(1), 0.0)
        self.comm.all_reduce(hidden)
        return hidden

    def _row_parallel(self, residual: torch.Tensor, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """residual + x @ weight.T; split over ranks, rank 0's part carries the residual and the others' only their
        product, so the all-reduce that follows (after LoRA adds its partial deltas) sums to the whole."""
        if self.comm is None or self.comm.rank == 0:
            return addmm(residual, x, weight)
        return linear(x, weight)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> float32 logits [num_rows, vocab]. Split over ranks, every rank computes its
        slice of the vocabulary and rank 0 gets them all; the other ranks get their own slice back (unused)."""
        logits = self._local_logits(hidden)
        if self.shard is None or self.comm is None:
            return logits
        width = self.shard.vocab_per_rank
        if logits.shape[1] < width:  # the last rank's slice is shorter when the ranks do not divide the vocabulary
            logits = F.pad(logits, (0, width - logits.shape[1]))
        parts = self.comm.gather(logits.contiguous())
        if parts is None:
            return logits
        return torch.cat(parts, dim=1)[:, : self.checkpoint_config.vocab_size]

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.lm_head, torch.Tensor):  # int8
            return linear(hidden, self.lm_head).float()
        input_major = self.lm_head.stride(0) == 1  # matmul_layout's float32 copy: fastest whole
        if self.device.type != "cpu" or input_major or self.lm_head.shape[0] <= _LM_HEAD_SLICE:
            return F.linear(hidden, self.lm_head).float()
        parts = [F.linear(hidden, w) for w in torch.split(self.lm_head, _LM_HEAD_SLICE)]
        return torch.cat(parts, dim=-1).float()
