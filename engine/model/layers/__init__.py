"""What the model families share: RoPE variants, RMSNorm variants, gated MLP activations and the per-layer attention
spec (sliding windows, soft-capping, sinks), as vLLM's `model_executor/layers` serves its `models/`. A family module
(engine/model/llama.py, qwen3.py, gemma.py, phi3.py) says which of these its checkpoints use; the decoder
(engine/model/decoder.py) composes them."""
