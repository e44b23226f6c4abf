"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

Weights are plain tensors, fused where one matmul can do the work of several (q/k/v, gate/up): fewer, larger
matmuls are what a CPU (and a GPU at small batch) runs fastest. Every forward takes a ForwardBatch of flat tokens
from many sequences at once; attention reads each sequence's keys through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.engine.errors import CheckpointError
from loraplex.engine.forward_batch import ForwardBatch
from loraplex.engine.lora_batch import LoraCompute
from loraplex.engine.model_config import ModelConfig
from loraplex.engine.page_pool import KVLayer
from loraplex.engine.rope import RotaryEmbedding, interleave_rotary_rows
from loraplex.engine.weights import CheckpointTensors
from loraplex.kernels.paged_attention import paged_attention

# lm_head in vocabulary slices this tall: the slice of weights stays in cache while every row uses it, which
# measured about 1.35x faster than one [num_rows, vocab] matmul on a 2-core CPU at vocab 32000.
_LM_HEAD_SLICE = 2048


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]: q, k, v projections stacked
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2)
    o: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate and up projections stacked
    down: torch.Tensor  # [hidden, intermediate]


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
    ) -> None:
        self.config = config
        self.dtype = dtype
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
        self.lm_head = torch.empty(0)

    # --- loading -------------------------------------------------------------------------------------------------

    def load(self, tensors: CheckpointTensors) -> None:
        c = self.config
        self.embed = self._take(tensors, "model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.norm = self._take(tensors, "model.norm.weight", (c.hidden_size,))
        if c.tie_word_embeddings or "lm_head.weight" not in tensors.names:
            if not c.tie_word_embeddings:
                raise CheckpointError("the checkpoint has no 'lm_head.weight' and config.json does not tie embeddings")
            self.lm_head = self.embed
        else:
            self.lm_head = self._take(tensors, "lm_head.weight", (c.vocab_size, c.hidden_size))
        self.layers = [self._load_layer(tensors, i) for i in range(c.num_layers)]

    def _load_layer(self, tensors: CheckpointTensors, i: int) -> LayerWeights:
        c = self.config
        p = f"model.layers.{i}."
        q = self._take(tensors, p + "self_attn.q_proj.weight", (c.q_size, c.hidden_size))
        k = self._take(tensors, p + "self_attn.k_proj.weight", (c.kv_size, c.hidden_size))
        v = self._take(tensors, p + "self_attn.v_proj.weight", (c.kv_size, c.hidden_size))
        q = interleave_rotary_rows(q, c.num_heads, c.head_dim)
        k = interleave_rotary_rows(k, c.num_kv_heads, c.head_dim)
        bias = None
        if c.attention_bias:
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
        gate = self._take(tensors, p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size))
        up = self._take(tensors, p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size))
        return LayerWeights(
            input_norm=self._take(tensors, p + "input_layernorm.weight", (c.hidden_size,)),
            qkv=torch.cat([q, k, v]),
            qkv_bias=bias,
            o=self._take(tensors, p + "self_attn.o_proj.weight", (c.hidden_size, c.q_size)),
            post_norm=self._take(tensors, p + "post_attention_layernorm.weight", (c.hidden_size,)),
            gate_up=torch.cat([gate, up]),
            down=self._take(tensors, p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)),
        )

    def _take(self, tensors: CheckpointTensors, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors.names:
            raise CheckpointError(f"the checkpoint has no tensor '{name}'")
        tensor = tensors.get(name)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"tensor '{name}' in {tensors.file_of(name)} has shape {tuple(tensor.shape)}, "
                f"but config.json implies {shape}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"tensor '{name}' in {tensors.file_of(name)} has dtype {tensor.dtype}")
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
            if layer.qkv_bias is not None:
                tensors.append(layer.qkv_bias)
        return sum(t.numel() * t.element_size() for t in tensors)

    # --- forward -------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[KVLayer], lora: LoraCompute | None = None) -> torch.Tensor:
        """Run the decoder over the batch's tokens, writing their K/V into the cache; returns the final-normed
        hidden states [num_tokens, hidden]."""
        c = self.config
        hidden = F.embedding(batch.input_ids, self.embed)
        cis = self.rope.table(batch.positions)
        adapters = lora if lora is not None and batch.lora else None
        for index, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            if adapters is not None:
                adapters.add(batch.lora, index, "qkv", x, qkv)
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
            # addmm adds the residual inside the matmul: one pass over the activations fewer.
            attn = attn.view(-1, c.q_size)
            hidden = torch.addmm(hidden, attn, layer.o.t())
            if adapters is not None:
                adapters.add(batch.lora, index, "o", attn, hidden)

            x = rms_norm(hidden, layer.post_norm, c.rms_norm_eps)
            gate_up = F.linear(x, layer.gate_up)
            if adapters is not None:
                adapters.add(batch.lora, index, "gate_up", x, gate_up)
            act = F.silu(gate_up[:, : c.intermediate_size])
            act.mul_(gate_up[:, c.intermediate_size :])  # in place: a fresh large tensor costs page faults
            hidden = torch.addmm(hidden, act, layer.down.t())
            if adapters is not None:
                adapters.add(batch.lora, index, "down", act, hidden)
        return rms_norm(hidden, self.norm, c.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> float32 logits [num_rows, vocab]."""
        if self.device.type != "cpu" or self.lm_head.shape[0] <= _LM_HEAD_SLICE:
            return F.linear(hidden, self.lm_head).float()
        parts = [F.linear(hidden, w) for w in torch.split(self.lm_head, _LM_HEAD_SLICE)]
        return torch.cat(parts, dim=-1).float()
