"""API keys of tenants, and admin keys."""
