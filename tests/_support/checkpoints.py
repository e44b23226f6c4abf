"""Small random checkpoints made with transformers, one per Llama-family variant the engine must serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loraplex.engine.tools.demo import RandomModelSpec

VOCAB = 512

# Larger than transformers' default init (0.02), so logits spread and a wrong computation shows.
INIT_STD = 0.15

VARIANTS: dict[str, dict[str, Any]] = {
    # Llama with grouped-query attention.
    "llama-gqa": {"arch": "llama", "num_attention_heads": 4, "num_key_value_heads": 2},
    # Qwen2: biases on q, k and v.
    "qwen2-bias": {"arch": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2},
    # Tied input and output embeddings.
    "llama-tied": {"arch": "llama", "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True},
    # Llama 3 rope scaling, with positions past the original context so the scaling matters.
    "llama3-rope": {
        "arch": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "mistral": {"arch": "mistral", "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": None},
    # Mistral v0.1: a sliding window over every layer, shorter than the test prompts.
    "mistral-window": {"arch": "mistral", "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 24},
    # Qwen3: per-head q/k norms, a head_dim of its own (32, where hidden / heads is 16).
    "qwen3": {"arch": "qwen3", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    # Gemma 2: (1 + w) norms, sandwich norms, GELU-tanh, query_pre_attn_scalar, alternating sliding and global
    # layers, soft-capped scores and logits (small caps, so that the random model's values reach them), tied.
    "gemma2": {
        "arch": "gemma2",
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 24,
        "attn_logit_softcapping": 3.0,
        "final_logit_softcapping": 4.0,
    },
    # Gemma 3 (text): q/k norms, sliding layers with their own RoPE base, linear-scaled RoPE on the global one.
    "gemma3": {
        "arch": "gemma3",
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_local_base_freq": 10000.0,
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    },
    # Phi-3: fused qkv_proj and gate_up_proj, LongRoPE past 64 positions.
    "phi3": {
        "arch": "phi3",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "original_max_position_embeddings": 64,
        "pad_token_id": None,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.0 + 2.0 * i for i in range(8)],
        },
    },
    # Phi-4-mini: partial rotary (half of each head rotates), tied embeddings, and a sliding window.
    "phi3-partial": {
        "arch": "phi3",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "partial_rotary_factor": 0.5,
        "pad_token_id": None,
        "tie_word_embeddings": True,
        "sliding_window": 40,
    },
    # Mixtral: a sparse MoE block in every layer, top-2 of 4 experts renormalized (issue 38).
    "mixtral": {
        "arch": "mixtral",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
    },
    # Qwen3-MoE: q/k norms, top-3 of 8 experts not renormalized, and a dense MLP in layer 1 (mlp_only_layers).
    "qwen3-moe": {
        "arch": "qwen3_moe",
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [1],
        "norm_topk_prob": False,
    },
    # Qwen2-MoE: q/k/v biases, top-2 of 6 experts renormalized, a shared expert behind its sigmoid gate, and sparse
    # layers every second layer (decoder_sparse_step 2: layer 0 dense).
    "qwen2-moe": {
        "arch": "qwen2_moe",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 2,
        "norm_topk_prob": True,
    },
}

# The variants whose every path the new-family tests run (tests/engine/model/test_families.py).
FAMILY_VARIANTS = (
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "phi3-partial",
    "mistral-window",
    "mixtral",
    "qwen3-moe",
    "qwen2-moe",
)
MOE_VARIANTS = ("mixtral", "qwen3-moe", "qwen2-moe")


def make_checkpoint(
    path: Path, variant: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any
) -> Path:
    """Write a random checkpoint of `variant` (and a tokenizer) into `path` with transformers; `overrides` are
    config fields that replace the variant's (hidden_size=256, say)."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from loraplex.engine.tools.demo import write_tokenizer

    spec = dict(VARIANTS[variant])
    arch = spec.pop("arch")
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    }[arch]
    fields: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    config = config_cls(**{**fields, **spec, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    with torch.no_grad():
        # Norm weights start at 1.0; jitter them so a skipped or misplaced norm shows in the logits.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("bias"):
                param.normal_(0, INIT_STD)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.normal_(0, 1.0)  # a router that prefers experts clearly: no near-ties in the top-k
    model.save_pretrained(path)
    write_tokenizer(path, vocab_size=VOCAB)
    return path


# A sparse bigram language over the test vocabulary: each token is followed by one of three successors with
# probabilities 0.6 / 0.3 / 0.1 (entropy 0.90 nats). A random checkpoint's predictions are nearly flat, so any
# small change of its logits swaps near-tied top tokens; a few hundred steps on this language give a model that
# predicts something, which is what a question like "does quantization change the top-1 token?" needs.
_SUCCESSOR_PROBS = torch.tensor([0.6, 0.3, 0.1])


def _successors(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(VOCAB - 2, generator=generator)[:3] + 2 for _ in range(VOCAB)])


def bigram_text(num_sequences: int, length: int, seed: int) -> torch.Tensor:
    """[num_sequences, length] token ids drawn from the sparse bigram language (ids 2.., no bos/eos)."""
    successors = _successors()
    generator = torch.Generator().manual_seed(seed)
    text = torch.empty(num_sequences, length, dtype=torch.long)
    text[:, 0] = torch.randint(2, VOCAB, (num_sequences,), generator=generator)
    for t in range(1, length):
        pick = torch.multinomial(_SUCCESSOR_PROBS.expand(num_sequences, 3), 1, generator=generator).squeeze(1)
        text[:, t] = successors[text[:, t - 1], pick]
    return text


def make_trained_checkpoint(path: Path, variant: str, *, steps: int = 120, lr: float = 1e-2) -> Path:
    """make_checkpoint, then `steps` AdamW steps of 16 x 128 tokens of the bigram language (about 6 s on 2
    threads): the loss falls from 6.3 to about 1.1 and the top token's probability averages 0.64."""
    from transformers import AutoModelForCausalLM

    make_checkpoint(path, variant)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        batch = bigram_text(16, 128, seed=step)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path


def tiny_spec(max_position_embeddings: int = 256) -> RandomModelSpec:
    """The engine's own random Llama (no transformers) at the size the server tests use: 2 layers of 64."""
    return RandomModelSpec(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=max_position_embeddings,
    )


# A Hermes-style (Qwen 2.5) chat template: tools listed in the system turn, calls written as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, tool results as <tool_response> user turns.
HERMES_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a function as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "<|im_start|>assistant\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# A reasoning model's chat template in Qwen3's manner, opening the think block in the prompt as Qwen3's thinking
# models and DeepSeek R1 (0528) do; `enable_thinking: false` closes it there instead.
THINKING_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


def write_thinking_tokenizer(
    path: Path, *, vocab_size: int = VOCAB, chat_template: str = THINKING_CHAT_TEMPLATE
) -> Path:
    """The demo tokenizer with `<think>` and `</think>` as added tokens of their own, one id each (the last two ids
    of `vocab_size`), as reasoning models' tokenizers have them; not special, so they survive skip_special_tokens."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as BackendTokenizer

    from loraplex.engine.tools.demo import write_tokenizer

    write_tokenizer(path, vocab_size=vocab_size - 2, chat_template=chat_template)
    backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
    if backend.get_vocab_size() != vocab_size - 2:
        raise RuntimeError(f"the demo tokenizer did not fill {vocab_size - 2} ids")
    backend.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in ("<think>", "</think>")])
    backend.save(str(path / "tokenizer.json"))
    return path
