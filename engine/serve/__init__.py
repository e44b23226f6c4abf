"""The engine's faces: the offline `LLM`, the `AsyncEngine` thread, the OpenAI-compatible HTTP server (protocol,
serving, the adapter name registry, the edge guards), Prometheus metrics, fleet registration, and the
`loraplex engine ...` commands.

May import: engine.core and everything below it. Nothing in the engine imports engine.serve; the platform does.
"""
