"""The device's memory: one page pool that KV blocks and adapter weights share, the KV cache manager (block tables,
admission, growth and release) and the prefix cache (full blocks found again by content).

May import: engine.errors. It knows sequences only through the small protocol the KV manager declares, never the
engine's `Request`, and adapters only as pool pages.
"""
