"""The engine loop and what it drives: `EngineCore` (one model, one page pool, one scheduler; `step()` is schedule,
run, postprocess), the scheduler, the request, the model runner, the sampler and the output processor, and the
shapes requests and outputs take (`SamplingParams`, `RequestOutput`, `EngineConfig`).

May import: engine.lora, engine.model, engine.memory, engine.errors, kernels. Never engine.serve or engine.tools.
"""
