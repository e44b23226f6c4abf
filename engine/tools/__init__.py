"""Tools, not runtime: the demo model and adapter writers (random checkpoints with a real tokenizer and chat
template), used by `loraplex engine demo-model|demo-adapter`, the tests and the benchmarks.

May import anything in the engine; nothing at run time imports it.
"""
