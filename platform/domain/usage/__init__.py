"""Usage: one row per request, the source of billing."""
