"""The decoder every family runs (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3/4) over a paged KV cache.

A family is a ModelConfig (engine/model/config.py, read by the family's module): which norm, activation, RoPE, window,
soft-caps and extra norms its layers use. The forward composes engine/model/layers accordingly; nothing here
branches on a family's name.

Weights are plain tensors, fused where one matmul can do the work of several (q/k/v, gate/up): fewer, larger
matmuls are what a CPU (and a GPU at small batch) runs fastest. On a CPU, float32 projections and an untied
lm_head are kept in the layout their library multiplies fastest (quant_linear.matmul_layout: input-major for MKL,
row-major for oneDNN, which serves float32 on AMD CPUs).
With quantization the four projections of each layer are int8 or int4 weight objects instead
(engine/model/quant_linear.py), quantized at load one layer at a time (engine/model/decoder_weights.py), and an
untied lm_head becomes int8; everything else stays in the model's dtype.
Every forward takes a ForwardBatch of flat tokens from many sequences at once; attention reads each sequence's
keys through its block table.
Under tensor parallelism (a `ShardPlan` and a `Communicator`) the model keeps one rank's share of every weight, as
engine/model/tensor_parallel.py splits them, and its forward sums the row-parallel products over the ranks; `config`
is then the rank's local config (its heads and MLP slice), `checkpoint_config` the whole model's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from loraplex.engine.errors import CheckpointError
from loraplex.engine.memory.page_pool import KVLayer
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.decoder_weights import LayerWeights, WeightLoader
from loraplex.engine.model.forward_batch import ForwardBatch
from loraplex.engine.model.layers.activation import gated
from loraplex.engine.model.layers.attention import attend
from loraplex.engine.model.layers.moe import moe_mlp
from loraplex.engine.model.layers.norm import rms_norm
from loraplex.engine.model.layers.rope import RotaryEmbedding
from loraplex.engine.model.quant_linear import Weight, addmm, linear, nbytes, onednn_fp32
from loraplex.engine.model.quantization import QuantizationName
from loraplex.engine.model.tensor_parallel import Communicator, ShardPlan
from loraplex.engine.model.weights import CheckpointTensors

# A row-major lm_head (half types, tied embeddings) in vocabulary slices this tall: the slice of weights stays in
# cache while every row uses it (decision 0019 has the figures). A float32 one is stored input-major for MKL
# (matmul_layout) and runs whole, which is fastest for that layout; oneDNN runs a float32 one whole too (0055).
_LM_HEAD_SLICE = 2048


def _ordered(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """x's features in a projection's stored column order (GPTQ act-order), else x itself."""
    return x if order is None else x.index_select(1, order)


class DecoderModel:
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
        self.max_positions = max_positions
        self.rope = RotaryEmbedding(config.rope, config.head_dim, max_positions, device=device)
        self.local_rope = (
            RotaryEmbedding(config.local_rope, config.head_dim, max_positions, device=device)
            if config.local_rope is not None
            else None
        )
        self.scale = config.scale
        self.layers: list[LayerWeights] = []
        self.embed = torch.empty(0)
        self.norm = torch.empty(0)
        self.lm_head: Weight | None = torch.empty(0)

    # --- loading -------------------------------------------------------------------------------------------------

    @property
    def quantization_label(self) -> str | None:
        """What the layers' weights are: "int8" / "int4" / "fp8" (quantized at load), "gptq" / "awq" / "fp8" (read
        as the checkpoint holds them), or None."""
        if self.config.prequantized is not None:
            return self.config.prequantized.method
        if self.config.fp8 is not None:
            return "fp8"
        return self.quantization

    @property
    def uses_long_rope(self) -> bool:
        """Whether a sequence past the original context takes other rotations (LongRoPE): see `long_rope_for`."""
        return self.checkpoint_config.rope.has_long_factors

    def long_rope_for(self, num_prompt_tokens: int) -> bool:
        """Whether a sequence of this prompt takes LongRoPE's long factors, for all its tokens (decision 0045)."""
        scaling = self.checkpoint_config.rope.scaling
        return self.uses_long_rope and num_prompt_tokens > getattr(scaling, "original_max_position_embeddings", 0)

    def load(self, tensors: CheckpointTensors) -> None:
        loader = WeightLoader(
            tensors,
            self.checkpoint_config,
            dtype=self.dtype,
            device=self.device,
            quantization=self.quantization,
            shard=self.shard,
        )
        loader.check()
        self.embed = loader.embedding()
        self.norm = loader.final_norm()
        self.lm_head = loader.lm_head(self.embed)
        self.layers = [loader.layer(i) for i in range(self.checkpoint_config.num_layers)]

    @property
    def num_ranks(self) -> int:
        """Ranks the model is split over (1: not split)."""
        return self.shard.size if self.shard is not None else 1

    def weight_bytes(self) -> int:
        """Bytes of every weight the model keeps: quantized projections with their scales and zero points, and
        the parts in the model's dtype (embeddings, lm_head unless tied, norms, biases)."""
        weights: list[Weight] = [self.embed, self.norm]
        if self.lm_head is not None and self.lm_head is not self.embed:
            weights.append(self.lm_head)
        for layer in self.layers:
            weights += [*layer.small_tensors(), *layer.projections()]
        return sum(nbytes(w) for w in weights)

    def projection_bytes(self) -> int:
        """Bytes of the layers' four projections (quantization also changes an untied lm_head: see decoder_weights)."""
        return sum(nbytes(w) for layer in self.layers for w in layer.projections())

    # --- forward -------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_caches: list[KVLayer], between_layers: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """Run the decoder over the batch's tokens, writing their K/V into the cache; returns the final-normed
        hidden states [num_tokens, hidden]. `between_layers` is called after every layer: the engine may run
        another step there (EngineCore, interleaved steps), which writes only its own requests' pages."""
        c = self.config
        hidden = self._embed(batch.input_ids)
        if c.embed_scale is not None:
            # transformers multiplies by sqrt(hidden) rounded to the weights' dtype.
            hidden = hidden * torch.tensor(c.embed_scale, dtype=hidden.dtype)
        rope_positions = batch.positions if batch.rope_positions is None else batch.rope_positions
        cis = self.rope.table(rope_positions)
        local_cis = self.local_rope.table(rope_positions) if self.local_rope is not None else cis
        adapters = batch.lora
        for index, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            window = c.window(index)
            rope = self.local_rope if window is not None and self.local_rope is not None else self.rope
            x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps, c.norm_kind)
            qkv = linear(_ordered(x, layer.qkv_input_order), layer.qkv, layer.qkv_bias)
            if adapters is not None:
                adapters.add(index, "qkv", x, qkv)
            q, k, v = torch.split(qkv, [c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = q.view(-1, c.num_heads, c.head_dim)
            k = k.view(-1, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = rms_norm(q, layer.q_norm, c.rms_norm_eps, c.norm_kind)
                k = rms_norm(k, layer.k_norm, c.rms_norm_eps, c.norm_kind)
            layer_cis = local_cis if rope is self.local_rope else cis
            q = rope.apply(q, layer_cis)
            k = rope.apply(k, layer_cis)
            # index_copy_ of whole head_dim rows: far cheaper than advanced-index assignment into the strided view.
            kv = batch.group(cache.group) if batch.other_groups else None
            cache.rows.index_copy_(0, batch.k_rows if kv is None else kv.k_rows, k.reshape(-1, c.head_dim))
            cache.rows.index_copy_(0, batch.v_rows if kv is None else kv.v_rows, v.reshape(-1, c.head_dim))
            tables = batch.block_tables if kv is None else kv.block_tables
            attn = attend(q, cache, tables, batch, scale=self.scale, sliding_window=window, softcap=c.attn_softcap)
            attn = attn.view(-1, c.q_size)
            hidden = self._block_output(
                hidden, attn, _ordered(attn, layer.o_input_order), layer.o, layer.attn_out_norm, (index, "o"), batch
            )

            x = rms_norm(hidden, layer.post_norm, c.rms_norm_eps, c.norm_kind)
            if layer.moe is not None:
                assert c.moe is not None
                hidden = hidden + moe_mlp(
                    x, layer.moe, c.moe, adapters.experts(index) if adapters is not None else None
                )
                if between_layers is not None:
                    between_layers()
                continue
            assert layer.gate_up is not None
            assert layer.down is not None
            gate_up = linear(_ordered(x, layer.gate_up_input_order), layer.gate_up)
            if adapters is not None:
                adapters.add(index, "gate_up", x, gate_up)
            act = gated(gate_up, c.intermediate_size, c.hidden_act)
            hidden = self._block_output(
                hidden,
                act,
                _ordered(act, layer.down_input_order),
                layer.down,
                layer.mlp_out_norm,
                (index, "down"),
                batch,
            )
            if between_layers is not None:
                between_layers()
        return rms_norm(hidden, self.norm, c.rms_norm_eps, c.norm_kind)

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

    def _block_output(
        self,
        residual: torch.Tensor,  # [num_tokens, hidden]
        x: torch.Tensor,  # [num_tokens, in]: the projection's input, as LoRA reads it
        stored_x: torch.Tensor,  # x in the weight's stored column order (GPTQ act-order), else x
        weight: Weight,
        out_norm: torch.Tensor | None,  # Gemma's norm of the block's output, before the residual
        lora_key: tuple[int, str],  # (layer, group) of the adapters' delta
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """residual + the row-parallel projection of the block's output (o or down), with the adapters' deltas, summed
        over the ranks; Gemma normalizes that output before adding it, so it cannot ride in the matmul."""
        adapters = batch.lora
        if out_norm is None:
            hidden = self._row_parallel(residual, stored_x, weight)
            if adapters is not None:
                adapters.add(*lora_key, x, hidden)
            if self.comm is not None:
                self.comm.all_reduce(hidden)
            return hidden
        out = linear(stored_x, weight)
        if adapters is not None:
            adapters.add(*lora_key, x, out)
        if self.comm is not None:
            self.comm.all_reduce(out)
        return residual + rms_norm(out, out_norm, self.config.rms_norm_eps, self.config.norm_kind)

    def _row_parallel(self, residual: torch.Tensor, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """residual + x @ weight.T; split over ranks, rank 0's part carries the residual and the others' only their
        product, so the all-reduce that follows (after LoRA adds its partial deltas) sums to the whole."""
        if self.comm is None or self.comm.rank == 0:
            return addmm(residual, x, weight)
        return linear(x, weight)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> float32 logits [num_rows, vocab] (soft-capped where the family caps them).
        Split over ranks, every rank computes its slice of the vocabulary and rank 0 gets them all; the other ranks
        get their own slice back (unused)."""
        logits = self._local_logits(hidden)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
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
        lm_head = self.lm_head
        if lm_head is None and hidden.shape[0] == 0:  # a step of embedding requests only: no row samples
            width = self.shard.vocab_per_rank if self.shard is not None else self.checkpoint_config.vocab_size
            return hidden.new_zeros(0, width, dtype=torch.float32)
        if lm_head is None:
            raise CheckpointError(
                "this checkpoint has no lm_head (a bare decoder, as embedding models are saved): it cannot generate"
            )
        if not isinstance(lm_head, torch.Tensor):  # int8
            return linear(hidden, lm_head).float()
        input_major = lm_head.stride(0) == 1  # matmul_layout's float32 copy for MKL: fastest whole
        whole = input_major or lm_head.shape[0] <= _LM_HEAD_SLICE or onednn_fp32(hidden, lm_head)
        if self.device.type != "cpu" or whole:
            return linear(hidden, lm_head).float()
        parts = [F.linear(hidden, w) for w in torch.split(lm_head, _LM_HEAD_SLICE)]
        return torch.cat(parts, dim=-1).float()
