"""OpenAI-compatible completions for tenants, routed to engines."""
