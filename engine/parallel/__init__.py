"""Tensor parallelism: an engine split over N ranks, one process each, joined in one torch.distributed group
(gloo on a CPU, NCCL on CUDA). Rank 0 is the engine's own process: it schedules, keeps the pool's books, samples,
and sends each step's host batch to the other ranks (`group.TensorParallelGroup`), which run the same forward on
their shards (`worker`) and meet rank 0 in the forward's collectives (`comm`). Decision 0040.

May import: engine.lora, engine.model, engine.memory, engine.errors, kernels. Never engine.core or engine.serve.
"""
