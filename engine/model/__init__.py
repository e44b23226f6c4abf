"""The model and what it is made of: the checkpoint's config, its weights (safetensors, prequantized GPTQ/AWQ),
the Llama-family forward, RoPE, quantized linears, and the tokenizer and detokenizer.

May import: engine.memory (the paged KV layers attention writes), engine.errors, kernels. Adapters reach the forward
only through the LoRA hook it declares, so it never imports engine.lora.
"""
